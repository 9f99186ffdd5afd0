package queue

// LuaValidSerial is luaValidSerial, for the adversary tests that run
// test-only copies of claimScript (claimharness_adv_test.go).
const LuaValidSerial = luaValidSerial

// ClaimScriptHash is claimScript's SHA1: the copies are checked against
// it, so they are the script that ships, byte for byte.
func ClaimScriptHash() string { return claimScript.Hash() }

// AdvScriptHashes are the SHA1s of the scripts the refusal audit
// reordered, by the variable that holds each: the adversary tests' copies
// (scriptharness_adv_test.go) are checked against them.
func AdvScriptHashes() map[string]string {
	return map[string]string{
		"retryScript": retryScript.Hash(), "buryScript": buryScript.Hash(), "handBackScript": handBackScript.Hash(),
		"enqueueScript": enqueueScript.Hash(), "cancelScript": cancelScript.Hash(), "requeueScript": requeueScript.Hash(),
		"requeueTasksScript": requeueTasksScript.Hash(), "forwardScript": forwardScript.Hash(),
		"streamBuryScript": streamBuryScript.Hash(), "putTaskScript": putTaskScript.Hash(),
		"releaseScript": releaseScript.Hash(), "takeScript": takeScript.Hash(),
	}
}
