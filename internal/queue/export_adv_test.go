package queue

// LuaValidSerial is luaValidSerial, for the adversary tests that run
// test-only copies of claimScript (claimharness_adv_test.go).
const LuaValidSerial = luaValidSerial

// ClaimScriptHash is claimScript's SHA1: the copies are checked against
// it, so they are the script that ships, byte for byte.
func ClaimScriptHash() string { return claimScript.Hash() }
