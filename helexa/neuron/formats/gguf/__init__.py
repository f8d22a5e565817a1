"""GGUF (llama.cpp's format): format.py loads a file into our layers; unpack.py, names.py,
hybrid.py and experts.py are its parts; tokenizer.py builds a tokenizer from its metadata
(torch-free). The file's metadata and layouts, torch-free, are helexa/checkpoint/gguf*.py.
"""
