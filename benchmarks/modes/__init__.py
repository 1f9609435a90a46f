"""One module per ``bench.py`` mode: forward, backward, ladder, variants, serving."""
