"""The base model's own code, for a base model that transformers does not ship (a repository with `auto_map`,
converted with --trust-remote-code).

In the converted folder of such a model this file is replaced by one that imports the base model's configuration
and modeling files, copied beside it, and registers them with transformers' Auto classes (remote_code.py writes
it): the AttnRes config and model then build the base model where neither its repository nor attnres is
installed. A base model that transformers ships needs nothing, and this version registers nothing.
"""

BASE_CLASSES: dict = {}  # model type -> (config class, causal-LM class)
