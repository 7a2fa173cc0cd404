-- The reference: POST an acquire-sized JSON body to the empty endpoint.
dofile(debug.getinfo(1, "S").source:match("^@(.*/)") .. "common.lua")

local request_bytes

function init(args)
   common_init(args)
   request_bytes = post("/ref", lease_body("k-" .. RUN .. "-" .. id .. "-000000", ',"ttl_seconds":60'))
end

function request()
   return request_bytes
end

function response(status, headers, body)
   tally(status)
end
