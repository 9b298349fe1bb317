"""Performance measurements of clipfinetune (docs/design.md §10, issue 15). Timing lives here, never in tests/.

    nice -n 19 python -m benchmarks [--only 1,2,3] [--dag]    # --only 4 --dag: the DAG alone

Figures (each number is measured in the run that prints it; `benchmarks/results.json` keeps, per figure, the
newest run's rows with that run's date, command and machine):

1. our plain-CLIP Trainer vs `open_clip_train` on the same model, precision, batch size, shards and machine
   (`fig1_openclip`);
2. each method's step time over the plain-CLIP step, divided by its FLOP ratio (`fig2_methods`);
3. data stages: word_regions at COCO scale, sentences, shard writing, loader vs trainer consumption
   (`fig3_data`);
4. the whole sample DAG from scratch: wall time, peak RSS, and each stage's time against its budget (`fig4_dag`;
   only with `--dag`);
5. the real size: ViT-B-16 (224 px, batch 8) Trainer vs `open_clip_train` and the text-trimming gain, SAM vit_b
   seconds per 1024 x 768 image (`fig5_real`; only with `--only 5`).

Standalone: `python -m benchmarks.cpu_precision` (bf16 autocast against fp32 on this CPU: a contrastive step of the
tiny CLIP, interleaved). The research probes are `research/` (docs/research/).

Scratch files go to `benchmarks/_work/` (gitignored). The machine is a small shared CPU box: OpenMP threads are
told to sleep when idle (spinning threads made steps ~4x slower when the cores are shared).
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
