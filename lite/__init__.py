"""lite: offline quantization (RTN, later AWQ/GPTQ) into standard W4A16 checkpoint formats."""
