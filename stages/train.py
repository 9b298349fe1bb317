"""Stage `train@<run>`: fine-tune models/base with one method -> models/<run>/ and dvclive/train/<run>/.

    python stages/train.py --run <run> --method <method> [--stage train@<run>]
    torchrun --nproc_per_node N -- stages/train.py --run <run> --method <method>      # multi-GPU / multi-node

Params (only those dvc.yaml declares for the run): the shared `train.*` defaults, overridden key by key by the
method's group `train.<method>.*` (unknown keys are an error; a method may allow extra keys, e.g. MulCLIP's
`new_module_lr`, which go to the method); `model.precision`; and the run's own group `runs.<run>`, declared whole:
its `method` and the method's constructor arguments (loss weights, `terms`, `unlocked_vision_layers`, ...).
`train.batch_size` is the GLOBAL batch (the papers' number): each of the N ranks takes 1/N of it, so steps per epoch
and the schedule do not depend on the number of ranks. `train.epoch_unit` (image | method) sets what an epoch
iterates (`data/loader.py`): one example per image, or the method's own unit (captions, word-region pairs), as the
papers count epochs.

Resumable: checkpoints/<run>/last.pt (gitignored, not a DVC out, so DVC never deletes it; removed once the model is
exported unless `train.keep_checkpoint`) carries a fingerprint of
the declared params, the stage's deps (code, models/base, data/shards) and the world size: a killed run re-run
unchanged resumes; after `dvc exp run -S ...` or a code change the run starts from scratch. dvclive writes its curves
beside the checkpoint (checkpoints/<run>/dvclive), so a resumed run continues them; the finished folder is copied to
dvclive/train/<run>/, an output DVC's run cache can restore (a persisted output would keep the stage out of it).
"""
from __future__ import annotations

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import ROOT, stage_inputs, start

LONG_CONTEXT = 248                      # Long-CLIP's stretched context (GOAL, MulCLIP: ctx.tokenize_long)


def run_settings(params, run: str, method: str, method_cls) -> tuple[dict, dict]:
    """(training settings: shared train.* merged with train.<method>.*, the method's constructor kwargs)."""
    from clipfinetune.train import merge_train_settings

    train = dict(params["train"])
    train.pop("keep_checkpoint")                         # the stage's, not the optimiser's
    override = train.pop(method, {})
    groups = [k for k, v in train.items() if isinstance(v, dict)]
    if groups:
        raise ValueError(f"{params.stage}: unexpected training groups {groups} (the run's method is {method!r})")
    settings, extras = merge_train_settings(train, override, method_cls.train_keys, f"train.{method}")
    config = dict(params[f"runs.{run}"])
    if config.pop("method") != method:
        raise ValueError(f"{params.stage}: runs.{run}.method is not {method!r}")
    clash = set(config) & set(extras)
    if clash:
        raise ValueError(f"{params.stage}: {sorted(clash)} set in both runs.{run} and train.{method}")
    return settings, {**config, **extras}


def add_arguments(parser) -> None:
    parser.add_argument("--run", required=True, help="run name (the foreach key), e.g. clip, fsc_lhn_only")
    parser.add_argument("--method", required=True, help="method name, e.g. clip, fsc_clip")


def main() -> None:
    args, params, log = start(__doc__, lambda a: f"train@{a.run}", add_arguments)

    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.io import copy_dir, write_json
    from clipfinetune.methods import get_method
    from clipfinetune.models import export_model, load_model
    from clipfinetune.train import (
        Monitor,
        TrainConfig,
        Trainer,
        cleanup,
        fingerprint,
        init_distributed,
        per_rank_batch_size,
    )
    from clipfinetune.train.checkpoint import check_ranks_agree, remove_checkpoints, seed_everything
    from clipfinetune.train.config import resolve_precision

    method_cls = get_method(args.method)                 # fails early: "method X not implemented yet"
    settings, config = run_settings(params, args.run, args.method, method_cls)
    precision = params["model.precision"]
    log.info("method %s (run %s): %s; training %s", args.method, args.run, config, settings)

    dist = init_distributed(params["compute.device"])
    try:
        global_batch = int(settings["batch_size"])         # train.batch_size: the global batch (the papers')
        rank_batch = per_rank_batch_size(global_batch, dist.world_size)
        log.info("global batch %d = %d rank(s) x %d per rank, on %s", global_batch, dist.world_size, rank_batch,
                 dist.device)
        cfg = TrainConfig(**{**settings, "batch_size": rank_batch},
                          precision=resolve_precision(precision, dist.device, log))
        method = method_cls(**config)
        seed_everything(cfg.seed)
        model = load_model("local-dir:" + str(ROOT / "models" / "base"), device=dist.device)
        transform = model.train_transform() if cfg.train_transform == "random_resized_crop" else model.transform
        ctx = ExampleContext(transform, model.tokenize, model.image_size, token_span=model.token_span,
                             tokenize_long=lambda texts: model.tokenize(texts, context_length=LONG_CONTEXT),
                             random_geometry=cfg.train_transform == "random_resized_crop")
        loader = ShardLoader(ROOT / "data" / "shards", "train", method, ctx, batch_size=cfg.micro_batch_size,
                             seed=cfg.seed, num_workers=cfg.workers, epoch_unit=cfg.epoch_unit,
                             epoch_samples=cfg.epoch_samples, accum_steps=cfg.accum_steps,
                             rank=dist.rank, world_size=dist.world_size)
        fp = fingerprint(params.stage, {"run": args.run, "method": args.method, "train": settings,
                                        "precision": precision, "config": config},
                         stage_inputs(params.stage), dist.world_size)
        check_ranks_agree(fp, dist)
        checkpoint_dir = ROOT / "checkpoints" / args.run
        live_work = checkpoint_dir / "dvclive"           # survives a kill beside the checkpoint it resumes from
        trainer = Trainer(method, model, loader, cfg, checkpoint_dir=checkpoint_dir, fingerprint=fp, dist=dist,
                          desc=params.stage)
        resumed = trainer.resume()
        with Monitor(live_work, trainer.total_steps, trainer.step, resumed, dist.is_main, params.stage) as monitor:
            module = trainer.fit(monitor)
        if dist.is_main:
            export_model(method.final_model(module, model), ROOT / "models" / args.run)
            write_json(live_work / "data.json", {"samples": loader.num_samples, "wanted": loader.num_wanted,
                                                 "dropped_by_method": loader.dropped_by_method,
                                                 "epoch_unit": loader.epoch_unit, "units": loader.num_units,
                                                 "batches_per_epoch": loader.epoch_length(0),
                                                 "steps": trainer.total_steps, **dict(loader.stats),
                                                 "device": str(dist.device), "ranks": dist.world_size,
                                                 "global_batch": global_batch, "rank_batch": rank_batch})
            copy_dir(live_work, ROOT / "dvclive" / "train" / args.run)
            log.info("exported models/%s", args.run)
            if not params["train.keep_checkpoint"]:
                remove_checkpoints(checkpoint_dir)
        params.check_all_read()
    finally:
        cleanup()


if __name__ == "__main__":
    main()
