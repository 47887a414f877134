"""fxshard: SPMD sharding of global-shape PyTorch programs as an FX pass (torch.compile backend "fxshard")."""
from .layout import Layout, LayoutError, Piece
from .mesh import MeshAxis, MeshSpec

__all__ = ["Layout", "LayoutError", "MeshAxis", "MeshSpec", "Piece"]
