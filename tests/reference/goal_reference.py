"""Float64 per-sample reference for GOAL's losses, written from the paper's equations and docs/methods.md §3.2
(imports nothing from clipfinetune)."""
import math


def _cos(u, v):
    u, v = u.double(), v.double()
    return float(u @ v) / (math.sqrt(float(u @ u)) * math.sqrt(float(v @ v)))


def contrast(a, b, logit_scale, rows):
    """CLIP's L_contrast over the samples in `rows` (eqs. 12-13): mean of both InfoNCE directions."""
    total = 0.0
    for i in rows:
        total -= logit_scale * _cos(a[i], b[i]) - math.log(sum(math.exp(logit_scale * _cos(a[i], b[j])) for j in rows))
        total -= logit_scale * _cos(b[i], a[i]) - math.log(sum(math.exp(logit_scale * _cos(b[i], a[j])) for j in rows))
    return total / (2 * len(rows))


def tsl_side(pooled, target, rows, mode):
    """One side of eq. (14). diag: 1/n sum_i (sim_ii - 1)^2; identity: 1/n^2 sum_ij (sim_ij - [i==j])^2."""
    if mode == "diag":
        return sum((_cos(pooled[i], target[i]) - 1.0) ** 2 for i in rows) / len(rows)
    return sum((_cos(pooled[i], target[j]) - (1.0 if i == j else 0.0)) ** 2
               for i in rows for j in rows) / len(rows) ** 2
