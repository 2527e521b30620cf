"""The actor service: steps environments, explores, builds n-step chunks, sends them to replay."""
