"""Stage `train@<run>`: fine-tune models/base with one method -> models/<run>/ and dvclive/train/<run>/.

    python stages/train.py --run <run> --method <method> [--stage train@<run>]
    torchrun --nproc_per_node N -- stages/train.py --run <run> --method <method>      # multi-GPU / multi-node

Settings: data/runs/<run>.json, written by stage `run_settings` (clipfinetune/runs.py `resolve_runs`): the run's
method, its constructor kwargs (its weights from params `loss`, what the run changes, its `train.<method>` extras),
the training settings (`train.*` merged with `train.<method>.*`) and `model.precision`. A `foreach` cannot declare
one run's `loss.*` keys; depending on that one file re-trains exactly the runs whose effective settings change.
Declared params: the stage's own `train.keep_checkpoint` and the device/ranks (`compute.*`).
`train.batch_size` is the GLOBAL batch (the papers' number): each of the N ranks takes 1/N of it, so steps per epoch
and the schedule do not depend on the number of ranks. `train.epoch_unit` (image | method) sets what an epoch
iterates (`data/loader.py`): one example per image, or the method's own unit (captions, word-region pairs), as the
papers count epochs. `model.precision: auto` trains in bf16 where the device has it natively, fp32 otherwise; the
precision it ran in is recorded in dvclive/train/<run>/data.json.

Resumable: checkpoints/<run>/last.pt (gitignored, not a DVC out, so DVC never deletes it; removed once the model is
exported unless `train.keep_checkpoint`) carries a fingerprint of the run's settings, the stage's deps (code,
models/base, data/shards, data/runs/<run>.json) and the world size: a killed run re-run unchanged resumes; after
`dvc exp run -S ...` or a code change the run starts from scratch. dvclive writes its curves beside the checkpoint
(checkpoints/<run>/dvclive), so a resumed run continues them; the finished folder is copied to dvclive/train/<run>/,
an output DVC's run cache can restore (a persisted output would keep the stage out of it).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import ROOT, TrainingBatch, compute_device, params_yaml, stage_inputs, start


def run_settings(run: str, method: str) -> dict:
    """data/runs/<run>.json (stage run_settings): {method, config, train, precision}."""
    import json

    path = ROOT / "data" / "runs" / f"{run}.json"
    if not path.is_file():
        raise SystemExit(f"{path.relative_to(ROOT)} does not exist: run `dvc repro run_settings` (run {run!r} must be "
                         f"an entry of params `runs`)")
    settings = json.loads(path.read_text())
    if settings["method"] != method:
        raise SystemExit(f"{path.relative_to(ROOT)}: method {settings['method']!r}, not {method!r}: run `dvc repro "
                         f"run_settings`")
    return settings


def training_batch(args, params) -> TrainingBatch:
    """The run's global batch and micro-batches (its data/runs/<run>.json), for the launcher's rank count
    (`_common.launch`), and the param that sets the batch, named when the ranks cannot split it."""
    from clipfinetune.runs import batch_param

    train = run_settings(args.run, args.method)["train"]
    return TrainingBatch(int(train["batch_size"]), int(train["accum_steps"]), batch_param(params_yaml(), args.method))


def add_arguments(parser) -> None:
    parser.add_argument("--run", required=True, help="run name (the foreach key), e.g. clip, fsc_lhn_only")
    parser.add_argument("--method", required=True, help="method name, e.g. clip, fsc_clip")


def main() -> None:
    args, params, log = start(__doc__, lambda a: f"train@{a.run}", add_arguments, training_batch)

    from clipfinetune import host
    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.methods import get_method
    from clipfinetune.models import load_model
    from clipfinetune.train import fingerprint
    from clipfinetune.train.session import training_session

    method_cls = get_method(args.method)                 # fails early: "method X not implemented yet"
    resolved = run_settings(args.run, args.method)
    settings, config = resolved["train"], resolved["config"]
    log.info("method %s (run %s): %s; training %s", args.method, args.run, config, settings)

    with training_session(settings, resolved["precision"], compute_device(), log=log) as session:
        cfg = session.cfg
        method = method_cls(**config)
        model = load_model("local-dir:" + str(ROOT / "models" / "base"), device=session.dist.device)
        random_crop = cfg.train_transform == "random_resized_crop"
        ctx = ExampleContext.of_model(model, random_geometry=random_crop)
        loader = ShardLoader(ROOT / "data" / "shards", "train", method, ctx, batch_size=cfg.micro_batch_size,
                             seed=cfg.seed, num_workers=host.count("train"), epoch_unit=cfg.epoch_unit,
                             epoch_samples=cfg.epoch_samples, accum_steps=cfg.accum_steps,
                             rank=session.dist.rank, world_size=session.dist.world_size,
                             pin_memory=session.dist.device.type == "cuda")
        fp = fingerprint(params.stage, {"run": args.run, **resolved, "precision": cfg.precision},
                         stage_inputs(params.stage), session.dist.world_size)
        checkpoint_dir = ROOT / "checkpoints" / args.run
        live_work = checkpoint_dir / "dvclive"           # survives a kill beside the checkpoint it resumes from
        trainer = session.trainer(method, model, loader, checkpoint_dir=checkpoint_dir, fingerprint=fp,
                                  desc=params.stage)
        module = session.fit(trainer, live_work)
        session.export(method.final_model(module, model), ROOT / "models" / args.run, live_dir=live_work,
                       record={"samples": loader.num_samples, "wanted": loader.num_wanted,
                               "dropped_by_method": loader.dropped_by_method,
                               "epoch_unit": loader.epoch_unit, "units": loader.num_units,
                               "batches_per_epoch": loader.epoch_length(0), "steps": trainer.total_steps,
                               **dict(loader.stats)},
                       publish_to=ROOT / "dvclive" / "train" / args.run,
                       checkpoint_dir=checkpoint_dir, keep_checkpoint=params["train.keep_checkpoint"])
        log.info("exported models/%s", args.run)
        params.check_all_read()

if __name__ == "__main__":
    main()
