"""Float64 per-sample reference for HarmoCLIP's losses, written from the paper's equations (imports nothing
from clipfinetune). Pairs i with valid[i] False take no part; with `category`, off-diagonal j of the same
category as i are left out of the sums of eq. (7)."""
import math


def _cos(u, v):
    return float(u @ v) / (math.sqrt(float(u @ u)) * math.sqrt(float(v @ v)))


def gc_loss(image, text, logit_scale):
    """eq. (2): -1/2N sum_i [log softmax_j s(v_i,t_j)/tau + log softmax_j s(t_i,v_j)/tau]."""
    image, text = image.double(), text.double()
    n = image.shape[0]
    total = 0.0
    for i in range(n):
        num = logit_scale * _cos(image[i], text[i])
        total -= num - math.log(sum(math.exp(logit_scale * _cos(image[i], text[j])) for j in range(n)))
        num = logit_scale * _cos(text[i], image[i])
        total -= num - math.log(sum(math.exp(logit_scale * _cos(text[i], image[j])) for j in range(n)))
    return total / (2 * n)


def lexeme(tokens, word_mask, i):
    """l_i = mean of the word's token states (eqs. 3-4, multi-token words averaged)."""
    idx = [t for t in range(tokens.shape[1]) if bool(word_mask[i, t])]
    return sum(tokens[i, t].double() for t in idx) / len(idx)


def lexeme_from_hidden(normed_hidden, projection, word_mask, i):
    """eqs. (3)-(4) as read in losses/harmoclip.py: the word's output states h (after the final LayerNorm) mapped
    into the joint space by the text projection P: mean_t(h_t) P (= the mean of the projected states)."""
    idx = [t for t in range(normed_hidden.shape[1]) if bool(word_mask[i, t])]
    mean = sum(normed_hidden[i, t].double() for t in idx) / len(idx)
    return mean @ projection.double()


def lrc_loss(region, tokens, word_mask, logit_scale, valid, category=None):
    """eq. (7) over the valid pairs; optional same-category masking of off-diagonal pairs."""
    pairs = [i for i in range(region.shape[0]) if bool(valid[i]) and bool(word_mask[i].any())]
    r = {i: region[i].double() for i in pairs}
    l_ = {i: lexeme(tokens, word_mask, i) for i in pairs}

    def candidates(i):
        if category is None:
            return pairs
        return [j for j in pairs if j == i or int(category[j]) != int(category[i])]

    total = 0.0
    for i in pairs:
        js = candidates(i)
        total -= logit_scale * _cos(r[i], l_[i]) - math.log(
            sum(math.exp(logit_scale * _cos(r[i], l_[j])) for j in js))
        total -= logit_scale * _cos(l_[i], r[i]) - math.log(
            sum(math.exp(logit_scale * _cos(l_[i], r[j])) for j in js))
    return total / (2 * len(pairs))


def gr_loss(region, teacher, valid):
    """eq. (8): 1 - 1/B sum_i cos(R_i, E_i) over valid pairs."""
    pairs = [i for i in range(region.shape[0]) if bool(valid[i])]
    return 1.0 - sum(_cos(region[i].double(), teacher[i].double()) for i in pairs) / len(pairs)
