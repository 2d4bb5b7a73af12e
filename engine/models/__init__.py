"""The model shape catalogue: real architectures' parameter names and shapes from transformers config
classes (no download, no weights), and how tensor- and expert-parallel inference ranks slice them.
Benchmarks, the planner's scenarios and the CLI's ``plan`` command read it (``shapes``).
"""
