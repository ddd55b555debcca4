"""Logit rows that stress the top-k / top-p cut-offs, and a check of a cut-off against the
definition itself (float64 probabilities, not the integer mass the implementations share)."""
import torch


def hard_rows(V: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> logits [R, V] fp32, top_p [R] fp32, top_k [R] int64, one stress case per row."""
    g = torch.Generator().manual_seed(7)
    rows, ps, ks = [], [], []

    def add(row, p, k):
        rows.append(row.float())
        ps.append(p)
        ks.append(k)
    add(torch.randn(V, generator=g) * 3, 0.9, 50)                 # plain
    add(torch.randn(V, generator=g) * 2 - 40, 0.5, 1)             # all negative
    half = torch.randn(V, generator=g) * 3
    half[V // 2:] = float("-inf")                                 # masked tail
    add(half, 0.95, V // 2 + 10)                                  # k past the finite values
    peaked = torch.randn(V, generator=g)
    peaked[17] = 30.0                                             # one token holds ~all the mass
    add(peaked, 0.99, V)                                          # k = V keeps all
    add(torch.zeros(V), 0.3, 5)                                   # all tied
    ties = torch.randn(V, generator=g)
    ties[:300] = 4.0                                              # a tied group at the cut-off
    add(ties, 0.5, 150)
    add(torch.randn(V, generator=g) * 1e3, 0.7, V - 1)            # exp underflows for most
    add(torch.randn(V, generator=g), 1.0, 2)                      # p = 1 keeps all
    add(torch.randn(V, generator=g) * 5, 1e-6, 3)                 # only the top token
    return (torch.stack(rows).to(device), torch.tensor(ps, device=device),
            torch.tensor(ks, dtype=torch.int64, device=device))


def check_top_p(logits: torch.Tensor, p: torch.Tensor, tau: torch.Tensor, slack: float = 1e-6):
    """tau must be a value of its row (or -inf for p >= 1); the tokens strictly above it hold
    less than p of the probability and those at or above it at least p (within `slack`)."""
    probs = logits.double().softmax(dim=-1)
    for r in range(logits.shape[0]):
        if p[r] >= 1:
            assert tau[r] == float("-inf"), r
            continue
        assert bool((logits[r] == tau[r]).any()), f"row {r}: {tau[r]} is not a value of the row"
        above = float(probs[r][logits[r] > tau[r]].sum())
        at_or_above = float(probs[r][logits[r] >= tau[r]].sum())
        assert above < p[r] + slack and at_or_above >= p[r] - slack, (r, above, at_or_above)


def check_top_k(logits: torch.Tensor, k: torch.Tensor, tau: torch.Tensor):
    """tau is the k-th largest value (ties counted), or -inf where k >= V."""
    V = logits.shape[1]
    ordered = logits.sort(dim=-1, descending=True).values
    for r in range(logits.shape[0]):
        want = float("-inf") if k[r] >= V else ordered[r, k[r] - 1]
        assert tau[r] == want, (r, tau[r], want)
