"""Stage `pretrain`: the small base CLIP, trained from scratch on the short captions of `pretrain.sources` ->
models/base/.

Global contrastive (the plain CLIP method) on every image of those sources with one of its captions drawn at
random each epoch, read by the sources' readers (not the shards: they need LISM pairs, and LISM on the sample
world uses this model). On the sample world the source is `pretrain`, the pretraining-only split.
`pretrain.one_colour_share` of every batch holds images of one colour (`train.sources.CaptionPairSource`). Before
the contrastive steps, `pretrain.label_warmup_steps` steps train the image tower to name the shapes and colours of
each image (`train.label_warmup`, the LiT-style supervised start; 0 = off), and with `pretrain.label_warmup_regions`
each object's from its RoIAligned dense feature; `pretrain.region_text_weight` adds the region-text term to the
contrastive steps (`train.pretraining`, `losses/pretrain.py`: each object's dense feature against the batch's object
names).

With real weights (`model.pretrained` set: an open_clip tag, a checkpoint file or an exported folder) nothing is
trained: the given weights are exported unchanged into models/base/ (the open_clip local-dir layout), and
dvclive/pretrain/ holds only skipped.json, which records why (a from-scratch run removes that note again). The
weights themselves are not a DVC dependency (the param is): after changing a file or folder in place, run
`dvc repro -f pretrain`.

Resumable: checkpoints/pretrain/last.pt (gitignored, not a DVC out) carries a fingerprint of the declared params,
the stage's inputs and code; a killed run re-run with the same fingerprint resumes, anything else starts over. The
curves grow beside it (checkpoints/pretrain/dvclive) and are copied to dvclive/pretrain/ at the end (not a persisted
output, so DVC's run cache can restore the stage).
Multi-GPU: `torchrun --nproc_per_node N stages/pretrain.py --stage pretrain` (or `compute.nproc`). `pretrain.batch_size`
is the GLOBAL batch, as `train.batch_size`: each of the N ranks takes 1/N of it (an error if N does not divide it),
so steps and schedule do not depend on N; the label warm-up (the same on every rank) takes the whole batch.
"""
from __future__ import annotations

import os
import shutil

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import ROOT, source_specs, stage_inputs, start

GROUP_KEY = "colour"        # record.extra key (COCO images[]) of the pretraining split: the group of one_colour_share
LABEL_KEY = "labels"        # record.extra key: the shapes and colours the label warm-up predicts
REGION_KEY = "regions"      # record.extra key: every object's box, labels and name (warm-up and region-text terms)
OWN_KEYS = ("sources", "one_colour_share", "label_warmup_steps", "label_warmup_lr", "label_warmup_regions",
            "region_text_weight", "keep_checkpoint")   # keys TrainConfig does not hold


def main() -> None:
    _, params, log = start(__doc__, "pretrain")
    name, pretrained, precision = params["model.name"], params["model.pretrained"], params["model.precision"]
    settings = dict(params["pretrain"])
    sources = source_specs(params, params["pretrain.sources"])
    out, live_dir = ROOT / "models" / "base", ROOT / "dvclive" / "pretrain"

    from clipfinetune.io import copy_dir, write_json
    from clipfinetune.models import export_model, load_model, quick_gelu_setting

    quick_gelu = quick_gelu_setting(params["model.quick_gelu"])   # for weights that do not record it
    if pretrained:
        log.info("model.pretrained=%r: exporting these weights unchanged to %s (no pretraining)", pretrained, out)
        if int(os.environ.get("RANK", "0")) == 0:          # under torchrun, one writer
            export_model(load_model(name, pretrained, quick_gelu=quick_gelu), out)
            shutil.rmtree(live_dir, ignore_errors=True)    # no curves of an earlier from-scratch run beside the note
            write_json(live_dir / "skipped.json", {"pretrained": pretrained, "model": name,
                                                   "reason": "model.pretrained is set: weights exported unchanged"})
        params.check_all_read()
        return

    from clipfinetune.data.readers import read_source
    from clipfinetune.methods.clip import ClipMethod
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
    from clipfinetune.train.label_warmup import label_warmup
    from clipfinetune.train.pretraining import PretrainMethod
    from clipfinetune.train.sources import CaptionPairSource

    dist = init_distributed(params["compute.device"])
    try:
        group_share, label_steps = float(settings["one_colour_share"]), int(settings["label_warmup_steps"])
        warmup_regions = bool(settings["label_warmup_regions"]) and label_steps > 0
        region_text_weight = float(settings["region_text_weight"])
        global_batch = int(settings["batch_size"])       # pretrain.batch_size: the global batch, as train's
        rank_batch = per_rank_batch_size(global_batch, dist.world_size, "pretrain.batch_size")
        cfg = TrainConfig(**{k: v for k, v in settings.items() if k not in OWN_KEYS and k != "batch_size"},
                          batch_size=rank_batch, precision=resolve_precision(precision, dist.device, log))
        seed_everything(cfg.seed)                       # the same initial weights on every rank
        model = load_model(name, device=dist.device)
        records = [r for n, spec in sources.items() for r in read_source(n, spec)]
        source = CaptionPairSource(records, model.transform, model.tokenize, cfg.micro_batch_size, cfg.seed,
                                   dist.rank, dist.world_size, group_key=GROUP_KEY, group_share=group_share,
                                   label_key=LABEL_KEY if label_steps or region_text_weight else "",
                                   region_key=REGION_KEY if warmup_regions or region_text_weight else "")
        log.info("pretraining %s from scratch on %d images: %d epochs x %d steps, global batch %d = %d rank(s) x %d "
                 "per rank, %s on %s", name, len(source.image_ids), cfg.epochs, len(source), global_batch,
                 dist.world_size, rank_batch, cfg.precision, dist.device)
        fp = fingerprint(params.stage, {"model": {"name": name, "pretrained": pretrained, "precision": precision},
                                        "pretrain": settings}, stage_inputs(params.stage), dist.world_size)
        check_ranks_agree(fp, dist)
        method = PretrainMethod(region_text_weight) if region_text_weight > 0 else ClipMethod()
        checkpoint_dir = ROOT / "checkpoints" / "pretrain"
        live_work = checkpoint_dir / "dvclive"          # survives a kill beside the checkpoint it resumes from
        trainer = Trainer(method, model, source, cfg, checkpoint_dir=checkpoint_dir,
                          fingerprint=fp, dist=dist, desc="pretrain")
        resumed = trainer.resume()
        if label_steps and not resumed:                # a resumed run already holds the warmed-up weights
            log.info("label warm-up of the image tower: %d steps over %s", label_steps, source.label_names)
            label_warmup(model, source.images, source.labels, steps=label_steps,
                         lr=float(settings["label_warmup_lr"]), batch_size=global_batch, warmup=cfg.warmup,
                         wd=cfg.wd, seed=cfg.seed, normalize=source.normalize,
                         regions=source.regions if warmup_regions else None, precision=cfg.precision)
        with Monitor(live_work, trainer.total_steps, trainer.step, resumed, dist.is_main, "pretrain") as monitor:
            trainer.fit(monitor)
        if dist.is_main:
            export_model(model, out)
            write_json(live_work / "device.json", {"device": str(dist.device), "ranks": dist.world_size,
                                                   "global_batch": global_batch, "rank_batch": rank_batch})
            copy_dir(live_work, live_dir)
            log.info("exported %s", out)
            if not settings["keep_checkpoint"]:
                remove_checkpoints(checkpoint_dir)
        params.check_all_read()
    finally:
        cleanup()


if __name__ == "__main__":
    main()
