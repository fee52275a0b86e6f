"""Projection heads of Sec. 3.2 of the xCLIP paper."""

from __future__ import annotations

from torch import nn


def clip_head(in_dim: int, embed_dim: int) -> nn.Module:
    """CLIP head: a single linear layer without bias (Sec. 3.2: 512-d)."""
    return nn.Linear(in_dim, embed_dim, bias=False)


class NclipHead(nn.Sequential):
    """nCLIP head: Linear(d, 4096) → BN → GELU → Linear(4096, K) → BN(affine=False) (Sec. 3.2).

    The final affine-free BatchNorm standardises every prototype logit over the batch, so no
    prototype can dominate the softmax by a bias alone.
    """

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        super().__init__(
            nn.Linear(in_dim, hidden),
            nn.BatchNorm1d(hidden),
            nn.GELU(),
            nn.Linear(hidden, out_dim),
            nn.BatchNorm1d(out_dim, affine=False),
        )


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
