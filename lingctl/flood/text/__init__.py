"""Text in and out: prompts to token ids, chat templates in a sandbox, generated ids back to text."""
