"""The layers the heads are made of: the projection heads of Sec. 3.2 of the xCLIP paper (CLIP,
nCLIP, Tab. 9c/9d's variants), SwAV/BYOL's projection MLP (ProtoCLIP, CMSF, the SupCon family)."""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F


def clip_head(in_dim: int, embed_dim: int) -> nn.Module:
    """CLIP head: a single linear layer without bias (Sec. 3.2: 512-d)."""
    return nn.Linear(in_dim, embed_dim, bias=False)


def hidden_layers(in_dim: int, hidden: int, count: int) -> list[nn.Module]:
    """``count`` × (Linear → BN → GELU), the hidden layers of the nCLIP head (Sec. 3.2)."""
    layers: list[nn.Module] = []
    for i in range(count):
        layers += [nn.Linear(in_dim if i == 0 else hidden, hidden), nn.BatchNorm1d(hidden), nn.GELU()]
    return layers


class SharedLayers(nn.Sequential):
    """The hidden layers that xCLIP's CLIP and nCLIP heads share (Tab. 9d, "#SL"): ``count`` ×
    (Linear → BN → GELU) on the tower's feature; both heads then read its output [B, hidden]."""

    def __init__(self, in_dim: int, hidden: int, count: int):
        if count < 1:
            raise ValueError(f"shared layers need count >= 1, got {count}")
        super().__init__(*hidden_layers(in_dim, hidden, count))


class L2Norm(nn.Module):
    """x / ||x||₂ over the last dimension: the ℓ2-norm layer of the prototype heads the xCLIP paper
    draws on (Tab. 9c, after DINO/SwAV: the last linear layer then scores a unit vector)."""

    def forward(self, x):  # [B, D] → [B, D]
        return F.normalize(x, dim=-1)


class Temperature(nn.Module):
    """x / τ: a fixed temperature on the nCLIP head's standardised logits (no parameter, so no
    state-dict key). Why: the last BatchNorm gives every logit column zero mean and unit variance
    over the batch, so a prototype shared by m of B rows reaches a logit of about √((B − m)/m) at
    most; at the paper's B = 4096 that allows sharp assignments, at a CPU batch of 128 it does not
    (docs/reproduction.md, "Why nCLIP learns little at small batches")."""

    def __init__(self, tau: float):
        super().__init__()
        if not tau > 0:
            raise ValueError(f"temperature must be > 0, got {tau}")
        self.tau = float(tau)

    def forward(self, x):  # [B, K] → [B, K]
        return x / self.tau

    def extra_repr(self) -> str:
        return f"tau={self.tau}"


class NclipHead(nn.Sequential):
    """nCLIP head: Linear(d, 4096) → BN → GELU → Linear(4096, K) → BN(affine=False) (Sec. 3.2).

    The final affine-free BatchNorm standardises every prototype logit over the batch, so no
    prototype can dominate the softmax by a bias alone.

    The Tab. 9c/9d ablations (all off by default; the default layout, and so its state-dict keys,
    is the one above): ``layers`` hidden layers (Linear → BN → GELU; Tab. 9d's #TL − #SL, 0 when all
    are shared), a ``bottleneck`` Linear(hidden, b) without activation before the last layer, an
    ``l2norm`` layer normalising the last layer's input, and ``last_bn=False`` dropping the final
    BatchNorm. ``temperature`` τ ≠ 1 divides the logits by τ (:class:`Temperature`; 1: Sec. 3.2).
    """

    def __init__(self, in_dim: int, hidden: int, out_dim: int, *, layers: int = 1, bottleneck: int | None = None,
                 l2norm: bool = False, last_bn: bool = True, temperature: float = 1.0):
        if layers < 0 or (bottleneck is not None and bottleneck < 1):
            raise ValueError(f"nCLIP head: layers {layers} must be >= 0 and bottleneck {bottleneck} >= 1")
        modules = hidden_layers(in_dim, hidden, layers)
        width = hidden if layers else in_dim
        if bottleneck is not None:
            modules.append(nn.Linear(width, bottleneck))
            width = bottleneck
        if l2norm:
            modules.append(L2Norm())
        modules.append(nn.Linear(width, out_dim))
        if last_bn:
            modules.append(nn.BatchNorm1d(out_dim, affine=False))
        if temperature != 1.0:
            modules.append(Temperature(temperature))
        super().__init__(*modules)


class ProjectionMLP(nn.Sequential):
    """Linear(d, hidden) → BN → ReLU → Linear(hidden, out): the projection MLP of SwAV and BYOL."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        super().__init__(
            nn.Linear(in_dim, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, out_dim),
        )


class ProtoHead(ProjectionMLP):
    """ProtoCLIP projection head g (ProtoCLIP paper, App. A.1: SwAV's head):
    Linear(d, 2048) → BN → ReLU → Linear(2048, 128). Its outputs h are L2-normalised by the
    objective (Algorithm 1 clusters and scores normalised projections)."""

    def __init__(self, in_dim: int, hidden: int = 2048, out_dim: int = 128):
        super().__init__(in_dim, hidden, out_dim)


class CmsfMLP(ProjectionMLP):
    """CMSF's projection and predictor MLPs (Sec. 3, after BYOL/MSF): Linear(d, 4096) → BN → ReLU →
    Linear(4096, 512). The projection sits on the image features, the predictor on the projection."""

    def __init__(self, in_dim: int, hidden: int = 4096, out_dim: int = 512):
        super().__init__(in_dim, hidden, out_dim)


class SupconMLP(ProjectionMLP):
    """The SupCon family's projection head (Khosla et al., "Supervised Contrastive Learning", Sec. 3:
    an MLP with one hidden layer of 2048 to a 128-d output, discarded after training):
    Linear(d, 2048) → BN → ReLU → Linear(2048, 128); its outputs are ℓ2-normalised by the loss. The
    BatchNorm is the house :class:`ProjectionMLP`'s (Khosla et al.'s head has none)."""

    def __init__(self, in_dim: int, hidden: int = 2048, out_dim: int = 128):
        super().__init__(in_dim, hidden, out_dim)
