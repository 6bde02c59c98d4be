"""The names of the files in a checkpoint directory, spelled once.

A checkpoint directory is a Hugging Face model directory (what ``save_pretrained`` writes, what vLLM and
transformers load) plus the training state lingctl resumes from. Plain constants, importing nothing: command
start-up reads them, and must not pay for torch to do so.
"""

CONFIG = "config.json"  # the model's shape and the transformers class that builds it
GENERATION_CONFIG = "generation_config.json"  # the stop and padding ids generation uses
WEIGHTS = "model.safetensors"  # the weights when they fit one file
WEIGHTS_INDEX = "model.safetensors.index.json"  # tensor name -> shard file, when the weights are sharded
SHARD_NAME = "model-{index:05d}-of-{total:05d}.safetensors"  # one shard of sharded weights, numbered from 1
TOKENIZER = "tokenizer.json"  # the tokenizer (tokenizers library format); a run directory keeps a copy too
TOKENIZER_CONFIG = "tokenizer_config.json"  # tokenizer class, special tokens and the chat template
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # the older place for the named special tokens
CHAT_TEMPLATE = "chat_template.jinja"  # a chat template kept beside tokenizer_config.json instead of in it
STATE_DIR = "state"  # the training state to resume from (optimizer, data position), a pcache (DCP) checkpoint
TRAIN_CONFIG = "train_config.json"  # the training settings the checkpoint was written under
LEGACY_TRAIN_STATE = "train_state.pt"  # the training state of checkpoints written before it moved into state/
