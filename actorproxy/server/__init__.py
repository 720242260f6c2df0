"""HTTP ingress: the Quart-trio app and the wire formats it speaks."""
