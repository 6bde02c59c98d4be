"""Model weights as flood serves them: the model directory, the streaming loader and int8 quantization."""
