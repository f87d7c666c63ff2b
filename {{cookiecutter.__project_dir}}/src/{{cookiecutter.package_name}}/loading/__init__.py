"""Data for the ranks: the resumable training sampler, exact evaluation shards and loader
workers{% if cookiecutter.example == "gpt" %}, and the token shards the example reads{% endif %}."""
