"""Reproducible experiments whose results are recorded in docs/ (run with `.venv/bin/python -m bench.<name>`)."""
