"""One room per training kind: what its step computes, how it is evaluated, what it needs from the house."""
