"""Task sets with their agents and rewards; calc is the default."""
