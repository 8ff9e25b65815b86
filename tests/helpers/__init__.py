"""Helpers shared by test modules: tiny runs and their command lines, data files and model directories, the
scripted dynamic sampling, the recording vLLM double. A test module imports its helpers from here (or
gets them as fixtures from a conftest.py), never from another test module (tests/test_test_layout.py)."""
