"""Ling's ``bailing_moe`` code for Hugging Face transformers, written beside the weights of every checkpoint.

lingctl never imports these modules itself: they are copied into a checkpoint directory, where config.json's
``auto_map`` names them, so ``AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True)`` runs the
model offline, with no code from the Hub. They depend on torch and transformers only (4.46 through 5.x).
"""
