"""The GPU side of each model family (its weights and dispatch plans) and the session driver they share."""
