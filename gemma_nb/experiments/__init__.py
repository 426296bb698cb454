"""The notebooks' experiments: one module per experiment, its head naming the notebook; products
never import them."""
