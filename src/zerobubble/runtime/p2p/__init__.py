"""Point-to-point transport between pipeline ranks: process groups, framed messages, links."""
