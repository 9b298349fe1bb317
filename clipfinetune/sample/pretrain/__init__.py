"""The sample world's base CLIP, trained from scratch (stage `pretrain`; real runs start from `model.pretrained`):
`sources` (the caption pairs as batches), `label_warmup` (the image tower's supervised start), `method` and `loss`
(contrastive pretraining with the region-text term). Both phases run on the one `Trainer`."""
