"""The embedded sample world (docs/design.md §8): synthetic coloured shapes in the benchmarks' real formats
(`world.generate_world`, stage `sample`), and the from-scratch base CLIP pretrained on it (`pretrain/`, stage
`pretrain`). No imports here: each stage loads only the part it runs, so an edit of one re-runs only its stage."""
