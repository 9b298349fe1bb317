"""The `pretrain` stage's caption pairs as the Trainer's batches (`train.loop.BatchSource`), sample world only.

`CaptionPairSource` serves reader records with short captions (`clipfinetune.data.readers`; the sample world's
`pretrain` source) for training from scratch: every epoch each image appears once, with one of its captions drawn
at random, in a random order; every draw is a function of (seed, epoch) only, so an interrupted epoch resumes exactly.
Images are decoded and transformed once and kept in memory: the sample world is small and the pretrain budget is
minutes, so re-decoding JPEGs every epoch would only burn the CPU the model needs. A transform that ends in `Normalize`
after `ToTensor` (open_clip's) is kept as the uint8 pixels before the normalisation (a quarter of fp32) and normalised
per batch with the same operations, so the batches are the ones the full transform gives. Ranks split every global batch
(`batch_size * world_size` samples) into contiguous per-rank slices; the last partial batch is dropped.

One-colour share (`group_key`, `group_share`): a share of every global batch comes from ONE group (the value of
`group_key` in the record's `extra`, i.e. its COCO `images[]` entry; the sample world's pretraining split puts the
colour of the image's first object there), a different group each batch in a balanced random order; the rest of the
batch is the epoch's shuffle as usual. Inside the group's part only what differs within the group (the shape) tells the
captions apart, while the mixed part keeps colour worth learning. Contrastive pretraining from scratch on mixed batches
alone settles on colour, the fast feature, and stays shape-blind; batches of one colour alone forget colour (issue 22).

Labels (`label_key`): the record's list of names under that `extra` (`images[]`) key as a multi-hot row of
`labels` (columns: `label_names`, sorted), for the image tower's label warm-up (`sample.pretrain.label_warmup`). Regions
(`region_key`): the record's list of `{"box": xyxy pixels, "labels": [names]}` under that key, as boxes in
model-input pixels and multi-hot rows over the same columns (the warm-up's region term); each entry's `text`
names the object, and every batch then carries its objects' boxes (`region_boxes` [K, 5]: batch row, xyxy), names'
tokens (`region_text`) and name ids (`region_class`, into `region_texts`) for pretraining's region-text term.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torchvision import transforms as T

from clipfinetune.boxes import resize_boxes
from clipfinetune.io import InputError


class CaptionPairSource:
    def __init__(self, records: list, transform: Callable, tokenize: Callable, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, group_key: str = "", group_share: float = 0.0,
                 label_key: str = "", region_key: str = ""):
        if not 0.0 <= group_share <= 1.0:
            raise ValueError(f"group_share must lie in [0, 1], got {group_share}")
        records = [r for r in records if r.captions]
        if not records:
            raise InputError("pretrain sources", None, "no records with captions")
        self.image_ids = [r.image_id for r in records]
        to_pixels, self.normalize = split_normalize(transform)
        pixels, token_sets, sizes = [], [], []
        for r in records:
            image = r.read_image()
            sizes.append(image.size)
            pixels.append(to_pixels(image))
            token_sets.append(tokenize(list(r.captions)))
        self.images = torch.stack(pixels)
        self.counts = torch.tensor([len(t) for t in token_sets])
        width = int(self.counts.max())
        self.tokens = torch.stack([torch.cat([t, t[:1].expand(width - len(t), -1)]) for t in token_sets])
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.group_share = group_share
        self.groups: list[torch.Tensor] = []
        if group_share > 0:
            if not group_key:
                raise ValueError("group_share needs a group_key")
            members: dict = {}
            for i, r in enumerate(records):
                if group_key not in r.extra:
                    raise InputError(r.origin, r.image_id, f"image has no {group_key!r} (one-group batch share)")
                members.setdefault(r.extra[group_key], []).append(i)
            self.groups = [torch.tensor(v) for _, v in sorted(members.items(), key=lambda kv: str(kv[0]))]
        if region_key and not label_key:
            raise ValueError("region labels need a label_key (their columns are label_names)")
        self.label_names: list[str] = []
        self.labels = torch.zeros(len(self.image_ids), 0)
        objects: list[list[tuple[list, list[str], str]]] = []
        if label_key:                   # multi-hot [N, V] over the sorted names found (`label_warmup`)
            for r in records:
                if not isinstance(r.extra.get(label_key), list):
                    raise InputError(r.origin, r.image_id, f"image has no {label_key!r} list (label warm-up)")
            objects = [_objects(r, region_key) for r in records] if region_key else []
            # an object's labels may name what no one-object image shows (a small world): they get columns too
            self.label_names = sorted({str(x) for r in records for x in r.extra[label_key]}
                                      | {name for objs in objects for _, names, _ in objs for name in names})
            column = {name: j for j, name in enumerate(self.label_names)}
            self.labels = torch.zeros(len(self.image_ids), len(self.label_names))
            for row, r in enumerate(records):
                for name in r.extra[label_key]:
                    self.labels[row, column[str(name)]] = 1.0
        # per image: (boxes [k, 4] xyxy in model-input pixels, multi-hot labels [k, V]) of its objects, and their
        # names' tokens [k, L] and ids [k] into `region_texts` (sorted distinct names)
        self.regions: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.region_texts: list[str] = []
        self.region_tokens: list[torch.Tensor] = []
        self.region_classes: list[torch.Tensor] = []
        if region_key:
            input_size = tuple(self.images.shape[-2:])
            texts = []
            for r, objs, wh in zip(records, objects, sizes):
                boxes = torch.zeros(len(objs), 4)
                rows = torch.zeros(len(objs), len(self.label_names))
                for k, (box, names, text) in enumerate(objs):
                    try:
                        boxes[k] = torch.tensor(box, dtype=torch.float32)
                    except (TypeError, ValueError) as e:
                        raise InputError(r.origin, r.image_id, f"bad {region_key!r} box {box!r}: {e}") from e
                    for name in names:
                        rows[k, column[name]] = 1.0
                    texts.append(text)
                self.regions.append((resize_boxes(boxes, wh, input_size), rows))
            self.region_texts = sorted(set(texts))
            text_id = {t: j for j, t in enumerate(self.region_texts)}
            tokens = tokenize(self.region_texts) if texts else None
            start = 0
            for boxes, _ in self.regions:
                ids = torch.tensor([text_id[t] for t in texts[start:start + len(boxes)]], dtype=torch.long)
                start += len(boxes)
                self.region_classes.append(ids)
                self.region_tokens.append(tokens[ids] if len(ids) else tokens[:0])

    def __len__(self) -> int:
        return len(self.image_ids) // (self.batch_size * self.world_size)

    def epoch_length(self, epoch: int) -> int:           # loop.BatchSource: every epoch the same
        return len(self)

    def _order(self, epoch: int, g: torch.Generator) -> torch.Tensor:
        """The epoch's image order: len(self) global batches one after another. With a group share, batch b opens
        with `share * step` images of one group (each group's images in a shuffled cycle), then the epoch's shuffle
        of the images not yet used fills it; positions inside each global batch are shuffled (ranks get mixes)."""
        n, step = len(self.image_ids), self.batch_size * self.world_size
        perm = torch.randperm(n, generator=g)
        k = round(self.group_share * step)
        if not self.groups or k == 0:
            return perm
        n_batches = len(self)
        balanced = torch.arange(n_batches) % len(self.groups)
        batch_group = balanced[torch.randperm(n_batches, generator=g)]
        cycles = [members[torch.randperm(len(members), generator=g)] for members in self.groups]
        taken = [0] * len(self.groups)
        used = torch.zeros(n, dtype=torch.bool)
        heads = []
        for b in range(n_batches):
            j = int(batch_group[b])
            cycle = cycles[j]
            head = cycle[(torch.arange(k) + taken[j]) % len(cycle)]
            taken[j] += k
            used[head] = True
            heads.append(head)
        rest = perm[~used[perm]]
        if len(rest) < n_batches * (step - k):          # a share that used (almost) every image: reuse the shuffle
            rest = torch.cat([rest, perm])
        batches = []
        for b, head in enumerate(heads):
            batch = torch.cat([head, rest[b * (step - k):(b + 1) * (step - k)]])
            batches.append(batch[torch.randperm(step, generator=g)])
        return torch.cat(batches)

    def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = self._order(epoch, g)
        caption = (torch.rand(len(self.image_ids), generator=g) * self.counts).long()
        step = self.batch_size * self.world_size
        for i in range(start, len(self)):
            idx = order[i * step + self.rank * self.batch_size:i * step + (self.rank + 1) * self.batch_size]
            batch = {"image": self.normalize(self.images[idx]), "text": self.tokens[idx, caption[idx]]}
            if self.regions:          # every object of the batch: [batch row, xyxy], its name's tokens and id
                rows = [torch.cat([torch.full((len(self.regions[i][0]), 1), float(b)), self.regions[i][0]], 1)
                        for b, i in enumerate(idx.tolist())]
                batch["region_boxes"] = torch.cat(rows)
                batch["region_text"] = torch.cat([self.region_tokens[i] for i in idx.tolist()])
                batch["region_class"] = torch.cat([self.region_classes[i] for i in idx.tolist()])
            yield batch


def split_normalize(transform: Callable) -> tuple[Callable, Callable]:
    """(image -> stored tensor, stored batch -> model input). For a Compose whose last step is `Normalize` right
    after a to-tensor step: uint8 pixels (the to-tensor output x 255, exact for 8-bit images) and ToTensor's /255 +
    Normalize per batch. Any other transform: stored as it returns, identity per batch."""
    steps = getattr(transform, "transforms", [])
    if len(steps) < 2 or not isinstance(steps[-1], T.Normalize) or "ToTensor" not in type(steps[-2]).__name__:
        return transform, lambda batch: batch
    before, norm = T.Compose(steps[:-1]), steps[-1]
    mean = torch.tensor(norm.mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(norm.std, dtype=torch.float32).view(-1, 1, 1)

    def to_pixels(image) -> torch.Tensor:
        return torch.round(before(image) * 255).to(torch.uint8)

    def normalize(batch: torch.Tensor) -> torch.Tensor:
        return batch.float().div(255).sub_(mean).div_(std)

    return to_pixels, normalize


def _objects(record, key: str) -> list[tuple[list, list[str], str]]:
    """(box, label names, name) of each object in `record.extra[key]`: the one place a region entry is checked, with
    an error naming the record."""
    regions = record.extra.get(key)
    if not isinstance(regions, list):
        raise InputError(record.origin, record.image_id, f"image has no {key!r} list (label warm-up)")
    out = []
    for region in regions:
        try:
            if not isinstance(region["labels"], list):
                raise TypeError("'labels' is not a list")
            out.append((region["box"], [str(name) for name in region["labels"]], str(region["text"])))
        except (KeyError, TypeError) as e:
            raise InputError(record.origin, record.image_id, f"bad {key!r} entry {region!r}: {e}") from e
    return out
