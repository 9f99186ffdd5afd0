package queue

// LuaHelpers is luaHelpers, for the test that holds ParseLeaseRecord and
// the scripts' parse() in agreement.
const LuaHelpers = luaHelpers
