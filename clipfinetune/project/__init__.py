"""The project's tools, which read dvc.yaml and params.yaml (the library below them never does): `plan` (what
`dvc repro` would run, checked before any work), `validate` (every configured path, weight and endpoint), `profile`
(`clipfinetune recipe <paper>`: params.yaml for one paper's protocol), `data` (`clipfinetune data`: the real data's
manifest, state and fetch), `deps` (each stage's code) and `cli` (the `clipfinetune` command)."""
