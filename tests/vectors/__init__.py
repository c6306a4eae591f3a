"""Golden wire vectors (README.md here); ``python -m tests.vectors.make_vectors`` checks or writes them."""
