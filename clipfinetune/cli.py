"""The `clipfinetune` command's former entry point: environments installed before the project's tools moved to
clipfinetune/project/ still call `clipfinetune.cli:main` until reinstalled (`pip install -e .`)."""
from clipfinetune.project.cli import main

__all__ = ["main"]
