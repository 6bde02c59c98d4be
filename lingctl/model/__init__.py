"""The Ling MoE model (``BailingMoeForCausalLM``), shared by ``lingctl train`` and ``lingctl flood``.

Modules: ``config`` (LingConfig, config.json), ``presets``, ``layers`` (norm, RoPE, attention, MLP), ``moe``
(router, dispatch, MoE block), ``ling`` (the model), ``checkpoint`` (HF-layout save/load),
``safetensors_io``. Import the submodule you need: importing this package does not load torch.
"""
