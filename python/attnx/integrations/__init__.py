"""attnx as the attention of other libraries' models.

- :mod:`attnx.integrations.transformers`: ``"attnx"`` in Hugging Face transformers' attention registry.
- :mod:`attnx.integrations.timm` and :mod:`attnx.integrations.open_clip`: the converters that
  :func:`attnx.convert` and :func:`attnx.revert` apply to those libraries' attention modules.

Each module imports its library only when used: attnx never requires them.
"""
