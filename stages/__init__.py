"""The pipeline's stages, one script per dvc.yaml stage (`python stages/<name>.py`), thin: read the declared params,
call the library, write the outputs. Importable as `stages.<name>` (tests), with the helpers every stage shares in
stages/_common.py and the item stages' in stages/_items.py."""
