{{ cookiecutter.description | python_string(docstring=True) }}

__version__ = "0.1.0"
