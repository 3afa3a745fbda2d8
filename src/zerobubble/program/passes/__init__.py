"""The program passes, each a function from programs to programs (see ``builder.PASSES``)."""
