"""flodl_async: an asyncio-native launcher and orchestration daemon for distributed PyTorch training."""

__version__ = "0.1.0"
