"""Layer 1: model -> operator DAG -> stream plan -> captured CUDA graphs (``gpuloom.compile``).

``streams`` (the stream-assignment pass) is pure Python; the rest imports torch.
"""
