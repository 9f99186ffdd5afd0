package queue

// LuaHelpers is luaHelpers, for the test that holds ParseLeaseRecord and
// the scripts' parse() in agreement.
const LuaHelpers = luaHelpers

// ScriptArgs is scriptArgs, for the tests that hold what it sends and
// what it costs.
var ScriptArgs = scriptArgs
