"""What every layer may use: errors, config checking, run-folder paths, the machine (CPU, GPU,
precision, processes). Imports nothing else of attnlab."""
