"""The project's tools: they read dvc.yaml and params.yaml (the library below them never does)."""
