"""Training steps that part, diagnosed module by module on the weights they start from."""
