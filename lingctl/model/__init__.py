"""The Ling MoE model (``BailingMoeForCausalLM``), shared by ``lingctl train`` and ``lingctl flood``.

Modules: ``config`` (LingConfig, config.json), ``presets``, ``layers`` (norm, RoPE, attention, MLP), ``moe``
(router, dispatch, MoE block), ``ling`` (the model), ``checkpoint`` (HF-layout save/load),
``checkpoint_files`` (the file names in a checkpoint directory), ``safetensors_io``, ``tokenizer`` (byte-level
BPE). Import the submodule you need: importing this package does not load torch.
"""
