"""EAGLE-3: the head, its checkpoint layout, and the tree drafter."""
