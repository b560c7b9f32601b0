"""Mode `anchor` (KVComm): the policy, its gate, weights, offset correction and anchor storage."""
