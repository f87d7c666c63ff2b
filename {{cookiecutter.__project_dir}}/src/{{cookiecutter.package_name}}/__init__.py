"""{{ cookiecutter.description | replace('\\', '\\\\') | replace('"', '\\"') }}"""

__version__ = "0.1.0"
