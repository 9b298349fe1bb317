"""Float64 per-sample reference for the sample world's pretraining region-text term
(clipfinetune/sample/pretrain/loss.py), written from its formula (imports nothing from clipfinetune):
L_rt = -1/K sum_k log [ exp(s cos(r_k, t_c(k))) / sum_{c in C} exp(s cos(r_k, t_c)) ], C = the distinct names."""
import math


def _cos(u, v):
    return float(u @ v) / (math.sqrt(float(u @ u)) * math.sqrt(float(v @ v)))


def rt_loss(region, name_embedding, region_class, logit_scale):
    """`name_embedding`: {class id: embedding}, the batch's distinct names; `region_class[k]`: region k's name."""
    region = region.double()
    total = 0.0
    for k in range(region.shape[0]):
        scores = {c: logit_scale * _cos(region[k], e.double()) for c, e in name_embedding.items()}
        log_norm = math.log(sum(math.exp(v) for v in scores.values()))
        total -= scores[int(region_class[k])] - log_norm
    return total / region.shape[0]
