"""Float64 per-sample reference of DeGLA's losses, written from the paper's equations (DeGLA §3.3, eq. 4-10).

Imports nothing from clipfinetune. Conventions fixed by docs/methods.md and the module docstring: every sample's
valid negatives are extra image->text columns in eq. (4) (t-bar_{j,k}); missing negatives are excluded from
every sum; rows without a valid negative are dropped from IGC/TGC; tau = 1 / logit_scale.
"""
import torch


def dot(a, b):
    return (a * b).sum()


def base_loss(image, text, neg_text, neg_valid, logit_scale):
    """L_base = (L_I->T + L_T->I) / 2, eq. (4), (2), (5)."""
    b, k = neg_valid.shape
    l_i2t = 0.0
    for i in range(b):
        num = torch.exp(logit_scale * dot(image[i], text[i]))
        den = 0.0
        for j in range(b):
            den = den + torch.exp(logit_scale * dot(image[i], text[j]))
            for kk in range(k):
                if bool(neg_valid[j, kk]):
                    den = den + torch.exp(logit_scale * dot(image[i], neg_text[j, kk]))
        l_i2t = l_i2t - torch.log(num / den)
    l_t2i = 0.0
    for i in range(b):
        num = torch.exp(logit_scale * dot(text[i], image[i]))
        den = sum(torch.exp(logit_scale * dot(text[i], image[j])) for j in range(b))
        l_t2i = l_t2i - torch.log(num / den)
    return (l_i2t / b + l_t2i / b) / 2


def _own_choice(anchor, positive, neg_text, neg_valid, scale):
    losses = []
    for i in range(anchor.shape[0]):
        negs = [kk for kk in range(neg_valid.shape[1]) if bool(neg_valid[i, kk])]
        if not negs:
            continue
        num = torch.exp(scale * dot(anchor[i], positive[i]))
        den = num + sum(torch.exp(scale * dot(anchor[i], neg_text[i, kk])) for kk in negs)
        losses.append(-torch.log(num / den))
    return sum(losses) / len(losses) if losses else torch.zeros((), dtype=torch.float64)


def igc_loss(image, text, neg_text, neg_valid, logit_scale):
    """L_IGC, eq. (8)."""
    return _own_choice(image, text, neg_text, neg_valid, logit_scale)


def tgc_loss(text, teacher_text, neg_text, neg_valid, tgc_scale):
    """L_TGC, eq. (9): anchor t_i, positive t*_i, negatives t-bar_{i,k}."""
    return _own_choice(text, teacher_text, neg_text, neg_valid, tgc_scale)


def distill_loss(image, text, neg_text, t_image, t_text, t_neg_text, neg_valid):
    """L_Distill, eq. (7)."""
    total = 0.0
    for i in range(image.shape[0]):
        total = total + ((image[i] - t_image[i]) ** 2).sum() + ((text[i] - t_text[i]) ** 2).sum()
        for kk in range(neg_valid.shape[1]):
            if bool(neg_valid[i, kk]):
                total = total + ((neg_text[i, kk] - t_neg_text[i, kk]) ** 2).sum()
    return total
