"""Float64 per-sample reference for MulCLIP, written from the paper's equations (imports nothing from
clipfinetune). Learnable parameters (W_k, W_q, tau, SigLIP s and b) are passed in as plain tensors/floats."""
import math


def _vec(x):
    return [float(v) for v in x.double()]


def _dot(u, v):
    return sum(a * b for a, b in zip(u, v))


def _cos(u, v):
    return _dot(u, v) / (math.sqrt(_dot(u, u)) * math.sqrt(_dot(v, v)))


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def _gelu(x):
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def calibrate(x, valid, w_k, w_q, tau):
    """eq. (4) for one sample: X' = SoftMax(W_q sigma(X W_k)^T / tau) X, softmax over the valid inputs only.
    x: [N, d]; valid: list of bool; w_k: [d, d_k]; w_q: [N', d_k]. Returns a list of N' vectors."""
    rows = [_vec(r) for r in x]
    wk = [_vec(c) for c in w_k.T]                               # d_k columns of W_k
    keys = [[_gelu(_dot(r, c)) for c in wk] for r in rows]      # sigma(X W_k): [N, d_k]
    idx = [n for n in range(len(rows)) if valid[n]]
    out = []
    for q in (_vec(r) for r in w_q):
        alpha = _softmax([_dot(q, keys[n]) / tau for n in idx])
        out.append([sum(a * rows[n][k] for a, n in zip(alpha, idx)) for k in range(len(rows[0]))])
    return out


def attend(query, keys):
    """eqs. (5)-(6)/(9) for one query vector: SoftMax(q K^T / sqrt d) K."""
    d = len(query)
    alpha = _softmax([_dot(query, k) / math.sqrt(d) for k in keys])
    return [sum(a * k[j] for a, k in zip(alpha, keys)) for j in range(d)]


def sigmoid_row(anchor, candidates, positive, s, b):
    """SigLIP row loss: sum_j -log sigmoid(z_j (s cos(anchor, c_j) + b)), z = +1 at `positive`."""
    return sum(-_log_sigmoid((1.0 if j == positive else -1.0) * (s * _cos(anchor, c) + b))
               for j, c in enumerate(candidates))


def softmax_rows(a, b, i, scale):
    """Symmetric InfoNCE row i over paired lists a, b."""
    ab = [scale * _cos(a[i], c) for c in b]
    ba = [scale * _cos(b[i], c) for c in a]
    return -(math.log(_softmax(ab)[i]) + math.log(_softmax(ba)[i])) / 2


def batch_sigmoid(a, b, s, b0, valid=None):
    """L^batch_contrast (sigmoid) over paired rows, valid rows/columns only, 1/n_valid sum over rows."""
    n = len(a)
    idx = [i for i in range(n) if valid is None or valid[i]]
    total = 0.0
    for i in idx:
        total += sigmoid_row(a[i], [b[j] for j in idx], idx.index(i), s, b0)
    return total / len(idx)


def batch_softmax(a, b, scale, valid=None):
    idx = [i for i in range(len(a)) if valid is None or valid[i]]
    aa, bb = [a[i] for i in idx], [b[i] for i in idx]
    return sum(softmax_rows(aa, bb, k, scale) for k in range(len(idx))) / len(idx)


def wpr_sample(v_ref, t_ref, s, b):
    """eqs. (5)-(8) for one sample: L_recon^image + L_recon^text with the sigmoid L^sample_contrast."""
    rec_v = [attend(v, t_ref) for v in v_ref]                  # V' = A_{v->t} t'
    rec_t = [attend(t, v_ref) for t in t_ref]                  # T' = A_{t->v} v'
    img = sum(sigmoid_row(v_ref[i], rec_v, i, s, b) for i in range(len(v_ref))) / len(v_ref)
    txt = sum(sigmoid_row(t_ref[i], rec_t, i, s, b) for i in range(len(t_ref))) / len(t_ref)
    return img + txt


def sap(v_refs, sub, sub_valid, s, b):
    """eqs. (9)-(10): for each sentence i, v-bar^i_k (own sub-caption over own refined patches) against t_sub,i
    of every image with sentence i (sigmoid); averaged over all valid (image, sentence) rows."""
    n_img, n_sub = len(v_refs), len(sub[0])
    total, count = 0.0, 0
    for i in range(n_sub):
        imgs = [k for k in range(n_img) if sub_valid[k][i]]
        for k in imgs:
            v_bar = attend(sub[k][i], v_refs[k])
            total += sigmoid_row(v_bar, [sub[m][i] for m in imgs], imgs.index(k), s, b)
            count += 1
    return total / count
