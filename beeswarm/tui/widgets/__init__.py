"""One widget per file; they render what the apps hand them."""
